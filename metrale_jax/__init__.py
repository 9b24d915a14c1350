"""metrale-jax: a functional JAX/Pallas core for hybrid (Gated DeltaNet + gated attention) LMs with
MTP speculative decoding, and its circuit tools (`diff`, `memory`)."""

__version__ = "0.1.0"
