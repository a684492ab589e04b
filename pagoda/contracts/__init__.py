"""Plain data that crosses layer boundaries: what the scheduler decided for a step (`step`) and the
messages between the front ends and the engine core (`messages`).

Every layer may import this package; it imports nothing of Pagoda's above the base modules
(`pagoda.sampling_params`, `pagoda.outputs`, `pagoda.config`). See docs/architecture.md.
"""
