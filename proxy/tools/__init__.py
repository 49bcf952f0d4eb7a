"""Server tools: the kinds (http, python, builtin) and the registry that runs them."""
