"""The vLLM connector: ``KVRingConnector`` (``kv_connector_module_path: kvring.connector``).

``config`` and ``keys`` need no vLLM; the connector itself is imported lazily so that the rest
of kvring works where vLLM is not installed.
"""


def __getattr__(name: str):
    if name == "KVRingConnector":
        from .connector import KVRingConnector
        return KVRingConnector
    raise AttributeError(name)
