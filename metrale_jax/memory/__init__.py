"""The memory planner behind `metrale-jax memory`: will a serve fit a device, and how far does it go?

Modules: `devices` (device table, budget law), `source` (what `--checkpoint` names), `weights`
(weight bytes), `activations` (XLA's memory analysis of the compiled step programs, cached on
disk), `plan` (one evaluation, refusals, bisection), `advice` (inverse answers, warnings),
`report` (text and JSON), `errors`. Counts come from `metrale_jax.engine.capacity`, pool bytes
from `metrale_jax.engine.pool.allocate_pool` traced with `jax.eval_shape`.
"""
