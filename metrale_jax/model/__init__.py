"""The hybrid model: pure functions of (params, config, inputs, state)."""
