"""The scheduler's part of DRA for the fake API server: how Kubernetes allocates consumable capacity.

Rules (facts from Kubernetes' source: k8s.io/dynamic-resource-allocation/structured,
``consumable_capacity.go`` of the allocator, and pkg/apis/resource/validation for
what the API server accepts in a ResourceSlice; resource.k8s.io/v1, KEP-5075):
- ``consumed_capacity(requests, capacity, driver)`` is what one allocation
  of a device consumes, for EVERY capacity of the device (not only those
  asked): a capacity not asked consumes its policy's ``default``, or all
  of it without a policy; one asked with no policy consumes what was
  asked; with a ``validRange`` below ``min`` it consumes ``min``, else
  the request rounded up to the next whole ``step`` from ``min``; with
  ``validValues`` the first value not below the request. A request
  naming a capacity the device does not have (unqualified or qualified
  with the device's driver) -> None (the device does not fit). The result
  then ``violates_policy`` (past ``max``, not a whole step from ``min``,
  not one of ``validValues``; the default never violates) -> None.
- ``allocate(api, ...)`` allocates one request of one claim on a node as
  the scheduler does: the first device of the node's slices of the driver
  (in slice order) without a ``NoSchedule`` taint that fits -- a device
  without ``allowMultipleAllocations`` is taken whole, once; one with it
  takes an allocation while, per capacity, what every allocated claim
  consumed there plus this one stays within its ``value`` -- and stores
  the claim with ``spec`` (the request with ``capacity.requests``) and
  ``status.allocation`` (``shareID`` a new lower-case UUID and
  ``consumedCapacity`` for a shared device, quantities in canonical form).
  No device fits -> ``Unschedulable`` naming what was asked and why each
  device was passed over; nothing is stored.
- ``capacity_errors(document)`` is the API server's validation of the
  slice's request policies (``default`` required with a range or values;
  ``min`` and ``max`` within the capacity, ``default`` within the range;
  ``default`` and ``max`` whole steps from ``min``; ``min + step`` within
  the capacity; ``validValues`` ascending, at most 10, within the capacity,
  holding the default), each as the API server words it.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

from isolators.kubernetes.dra._sharing import parse_quantity

__all__ = ["Unschedulable", "consumed_capacity", "violates_policy", "allocate", "capacity_errors", "format_quantity"]


class Unschedulable(Exception):
    """The scheduler found no device for the claim; the message says why."""


def _q(text: Any) -> Decimal:
    return parse_quantity(str(text))


def format_quantity(value: Decimal, binary: bool) -> str:
    """A quantity in Kubernetes' canonical form (``10Gi``, ``1500M``, ``500m``, ``30``)."""
    if value != value.to_integral_value():
        return f"{int(value * 1000)}m"
    number = int(value)
    if number == 0:
        return "0"
    suffixes = (("Ei", 1 << 60), ("Pi", 1 << 50), ("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)) \
        if binary else (("E", 10 ** 18), ("P", 10 ** 15), ("T", 10 ** 12), ("G", 10 ** 9), ("M", 10 ** 6), ("k", 10 ** 3))
    for suffix, size in suffixes:
        if number % size == 0:
            return f"{number // size}{suffix}"
    return str(number)


def _binary(text: Any) -> bool:
    return str(text).endswith("i")


def _resolve(name: str, capacity: dict[str, Any], driver: str) -> str | None:
    """The device's capacity key a requested name refers to (unqualified = qualified with the driver)."""
    if name in capacity:
        return name
    domain, _, identifier = name.rpartition("/")
    if domain:
        return identifier if domain == driver and identifier in capacity else None
    qualified = f"{driver}/{name}"
    return qualified if qualified in capacity else None


def _consumed(requested: Decimal | None, entry: dict[str, Any]) -> Decimal:
    policy = entry.get("requestPolicy")
    if requested is None:
        if policy is not None and policy.get("default") is not None:
            return _q(policy["default"])
        return _q(entry["value"])
    if policy is None:
        return requested
    valid_range = policy.get("validRange")
    if valid_range is not None and valid_range.get("min") is not None:
        low = _q(valid_range["min"])
        if requested < low:
            return low
        if valid_range.get("step") is None:
            return requested
        step = _q(valid_range["step"])
        added = requested - low
        steps = added // step + (1 if added % step else 0)  # rounded up to the next whole step
        return low + steps * step
    if policy.get("validValues"):
        for value in policy["validValues"]:
            if requested <= _q(value):
                return _q(value)
    return requested


def violates_policy(consumed: Decimal, policy: dict[str, Any] | None) -> bool:
    """Whether a consumed amount breaks the capacity's request policy (see module rules)."""
    if policy is None:
        return False
    if policy.get("default") is not None and consumed == _q(policy["default"]):
        return False
    valid_range = policy.get("validRange")
    if valid_range is not None:
        if valid_range.get("max") is not None and consumed > _q(valid_range["max"]):
            return True
        if valid_range.get("step") is not None:
            return (consumed - _q(valid_range["min"])) % _q(valid_range["step"]) != 0
        return False
    if policy.get("validValues"):
        return all(consumed != _q(value) for value in policy["validValues"])
    return False


def consumed_capacity(requests: dict[str, str] | None, capacity: dict[str, Any], driver: str
                      ) -> dict[str, Decimal] | None:
    """What one allocation consumes of each capacity, None when the device does not fit (see module rules)."""
    asked: dict[str, Decimal] = {}
    for name, value in (requests or {}).items():
        key = _resolve(name, capacity, driver)
        if key is None:
            return None
        asked[key] = _q(value)
    consumed = {name: _consumed(asked.get(name), entry) for name, entry in capacity.items()}
    if any(violates_policy(value, capacity[name].get("requestPolicy")) for name, value in consumed.items()):
        return None
    return consumed


def _results_on(api: Any, driver: str, pool: str, device: str) -> list[dict]:
    return [result for claim in api.claims.values()
            for result in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])
            if (result["driver"], result["pool"], result["device"]) == (driver, pool, device)]


def _fit(api: Any, device: dict, driver: str, pool: str, requests: dict[str, str] | None
         ) -> tuple[dict[str, Decimal] | None, str]:
    """(consumed, "") when this allocation fits on ``device``, else (None, why)."""
    if any(taint.get("effect") == "NoSchedule" for taint in device.get("taints") or []):
        return None, "tainted NoSchedule"
    capacity = device.get("capacity") or {}
    held = _results_on(api, driver, pool, device["name"])
    if not device.get("allowMultipleAllocations"):
        if held:
            return None, "allocated"
        for name, value in (requests or {}).items():
            key = _resolve(name, capacity, driver)
            if key is None or _q(value) > _q(capacity[key]["value"]):
                return None, f"no capacity {name} of {value}"
        return {}, ""
    consumed = consumed_capacity(requests, capacity, driver)
    if consumed is None:
        return None, "the request does not meet the capacity's request policy"
    for name, value in consumed.items():
        total = value + sum(_q(r.get("consumedCapacity", {}).get(name, 0)) for r in held)
        if total > _q(capacity[name]["value"]):
            return None, f"{name}: {format_quantity(total, _binary(capacity[name]['value']))} past" \
                         f" {capacity[name]['value']}"
    return consumed, ""


def allocate(api: Any, namespace: str, name: str, *, driver: str, node: str, requests: dict[str, str] | None = None,
             request: str = "gpu", device_class: str = "share.gpu.isolator.dev", uid: str | None = None) -> dict:
    """Allocate one device for the claim's request as the scheduler does, and store the claim (see module rules)."""
    with api._changed:
        passed: list[str] = []
        for resource_slice in api.resource_slices.values():
            spec = resource_slice["spec"]
            if spec.get("driver") != driver or spec.get("nodeName") != node:
                continue
            pool = spec["pool"]["name"]
            for device in spec.get("devices") or []:
                consumed, why = _fit(api, device, driver, pool, requests)
                if consumed is None:
                    passed.append(f"{device['name']} ({why})")
                    continue
                result: dict[str, Any] = {"request": request, "driver": driver, "pool": pool,
                                          "device": device["name"]}
                if device.get("allowMultipleAllocations"):
                    capacity = device["capacity"]
                    result["shareID"] = str(uuid.uuid4())
                    result["consumedCapacity"] = {
                        key: format_quantity(value, _binary(capacity[key]["value"])) for key, value in consumed.items()}
                exactly: dict[str, Any] = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": 1}
                if requests:
                    exactly["capacity"] = {"requests": dict(requests)}
                claim = api.add_claim(namespace, name, [result], uid=uid)
                claim["spec"] = {"devices": {"requests": [{"name": request, "exactly": exactly}]}}
                return claim
        raise Unschedulable(f"claim {namespace}/{name} asking {requests or 'no capacity'} of driver {driver} on node"
                            f" {node}: no device fits ({'; '.join(passed) or 'no device published'})")


def _invalid(path: str, value: Any, why: str) -> str:
    return f'{path}: Invalid value: "{value}": {why}'


def capacity_errors(document: dict) -> list[str]:
    """The API server's errors for the request policies of a ResourceSlice (see module rules)."""
    errors = []
    for index, device in enumerate(document.get("spec", {}).get("devices") or []):
        for name, entry in (device.get("capacity") or {}).items():
            policy = entry.get("requestPolicy")
            if policy is None:
                continue
            path = f"spec.devices[{index}].capacity[{name}].requestPolicy"
            total = _q(entry["value"])
            valid_range, values = policy.get("validRange"), policy.get("validValues")
            if (valid_range is not None or values) and policy.get("default") is None:
                errors.append(f"{path}.default: Required value: required when"
                              f" {'validValues' if values else 'validRange'} is defined")
                continue
            default = _q(policy["default"]) if policy.get("default") is not None else None
            if values:
                numbers = [_q(v) for v in values]
                if numbers != sorted(numbers):
                    errors.append(_invalid(f"{path}.validValues", values, "values must be sorted in ascending order"))
                if len(values) > 10:
                    errors.append(f"{path}.validValues: Too many: {len(values)}: must have at most 10 items")
                errors += [_invalid(f"{path}.validValues[{i}]", v, f"option is larger than capacity value:"
                                                                    f" {entry['value']}")
                           for i, v in enumerate(values) if _q(v) > total]
                if default not in numbers:
                    errors.append(_invalid(f"{path}.validValues", policy["default"],
                                           "default value is not valid according to the requestPolicy"))
            elif valid_range is not None:
                path += ".validRange"
                if valid_range.get("min") is None:
                    errors.append(f"{path}.min: Required value: required when validRange is defined")
                    continue
                low = _q(valid_range["min"])
                if low > total:
                    errors.append(_invalid(f"{path}.min", valid_range["min"],
                                           f"min is larger than capacity value: {entry['value']}"))
                if default is not None and default < low:
                    errors.append(_invalid(f"{path}.min", policy["default"], f"default is less than min: {valid_range['min']}"))
                high = _q(valid_range["max"]) if valid_range.get("max") is not None else None
                if high is not None:
                    if low > high:
                        errors.append(_invalid(f"{path}.max", valid_range["min"], f"min is larger than max: {valid_range['max']}"))
                    if high > total:
                        errors.append(_invalid(f"{path}.max", valid_range["max"],
                                               f"max is larger than capacity value: {entry['value']}"))
                    if default is not None and default > high:
                        errors.append(_invalid(f"{path}.max", policy["default"], f"default is more than max: {valid_range['max']}"))
                if valid_range.get("step") is not None:
                    step = _q(valid_range["step"])
                    if low + step > total:
                        errors.append(_invalid(f"{path}.step", valid_range["step"],
                                               f"one step {low + step} is larger than capacity value: {entry['value']}"))
                    for value, text in ((default, policy["default"]), (high, valid_range.get("max"))):
                        if value is not None and (value - low) % step != 0:
                            errors.append(_invalid(f"{path}.step", text, f"value is not a multiple of a given step"
                                                                         f" ({valid_range['step']}) from ({valid_range['min']})"))
    return errors
