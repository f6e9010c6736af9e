"""The Kubernetes API client of the DRA driver (lightkube's ``AsyncClient``).

Rules:
- ``kube_client(kubeconfig, timeout_s)`` builds the client: from the
  kubeconfig file when given (its current context), else the pod's
  service account (in-cluster: ``KUBERNETES_SERVICE_HOST`` and the token
  under ``/var/run/secrets/kubernetes.io/serviceaccount``). A file that is
  missing, not YAML, or lacks a current context or its cluster, and an
  in-cluster start outside a pod, are one ``DraSetupError`` naming the
  file and what is wrong, on one line (the command exits 2);
  nothing is contacted before the config is known good.
- Every request is bounded by ``timeout_s`` (connect, read, write), so an
  API server that is down or slow fails one claim, not the driver.
- ``api_failure(error)`` is one line for a failed request: the API
  server's status and message, or the transport's error naming the server.
- The typed models are lightkube's for resource.k8s.io/v1
  (``lightkube.resources.resource_v1``); no request is written by hand.
"""

from __future__ import annotations

from typing import Any

from .._errors import PluginSetupError

__all__ = ["DraSetupError", "kube_client", "api_failure", "FIELD_MANAGER"]

FIELD_MANAGER = "gpu-isolator-dra-plugin"


class DraSetupError(PluginSetupError):
    """The driver cannot start as configured (kubeconfig, node name); the message says why."""


def _load_config(kubeconfig: str | None) -> Any:
    from lightkube import KubeConfig
    from lightkube.core.exceptions import ConfigError

    if kubeconfig is None:
        try:
            return KubeConfig.from_service_account()
        except (ConfigError, OSError, KeyError) as error:
            raise DraSetupError(
                f"No --kubeconfig given and not running in a pod (in-cluster config: {error}): pass"
                " --kubeconfig=FILE or run the driver as the DaemonSet in deploy/") from error
    try:
        config = KubeConfig.from_file(kubeconfig)
        single = config.get()
    except ConfigError as error:
        raise DraSetupError(f"Cannot use the kubeconfig {kubeconfig!r}: {error}") from error
    except Exception as error:  # noqa: BLE001 - YAML errors, a list where a mapping belongs, a missing key
        what = f"missing {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {_one_line(error)}"
        raise DraSetupError(f"Cannot use the kubeconfig {kubeconfig!r}: not a valid kubeconfig ({what})") from error
    if not getattr(single.cluster, "server", None):
        raise DraSetupError(f"Cannot use the kubeconfig {kubeconfig!r}: context {single.context_name!r} names no"
                            " cluster with a server")
    return config


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def kube_client(kubeconfig: str | None, timeout_s: float = 10.0) -> Any:
    """A lightkube ``AsyncClient`` (see module rules)."""
    import httpx2
    from lightkube import AsyncClient

    config = _load_config(kubeconfig)
    try:
        return AsyncClient(config=config, field_manager=FIELD_MANAGER, timeout=httpx2.Timeout(timeout_s))
    except Exception as error:  # noqa: BLE001 - unreadable certificates, a bad server URL
        raise DraSetupError(f"Cannot build a Kubernetes client from {kubeconfig or 'the in-cluster config'!r}:"
                            f" {type(error).__name__}: {_one_line(error)}") from error


def api_failure(error: BaseException) -> str:
    """One line for a failed API request (see module rules)."""
    from lightkube import ApiError

    if isinstance(error, ApiError):
        status = error.status
        return f"the API server answered {status.code} {status.reason or ''}: {status.message}".replace("  ", " ")
    request = getattr(error, "request", None)
    where = f" ({request.url.host}:{request.url.port})" if request is not None else ""
    return f"the API server{where} could not be reached: {type(error).__name__}: {str(error) or 'timed out'}"
