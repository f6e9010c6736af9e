"""The DRA driver's generated gRPC modules (see ``generate.py``)."""
