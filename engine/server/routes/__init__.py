"""The engine server's routers, one module per resource."""
