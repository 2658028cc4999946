"""The vLLM connector (KVConnectorBase_V1); see the connector issue."""
