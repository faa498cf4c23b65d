"""The decision core: a request body -> tokens -> block keys -> index lookup -> pod views ->
policy -> ranked pods, with no HTTP in it (both fronts call it the same way)."""
