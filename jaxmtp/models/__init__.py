"""Model families and their layers: config.json parsing into a ModelConfig, the params
pytree, and the pure forward functions (dense/GQA attention, MLA, MoE, linear/fp8)."""
