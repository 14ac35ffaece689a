"""The router's HTTP resources, one module each (the OpenAI API it fronts, health, metrics)."""
