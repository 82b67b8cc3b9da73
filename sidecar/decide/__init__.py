"""Pure decisions over observations, the clock passed in: health state, weights, the publish
gate, saturation and admission."""
