"""Built-in agent environments, by the name ``rollout.agent`` takes.

- ``relay``: the toy multi-turn task a tiny random model learns on CPU (envs/relay.py).
- ``calculator``: GSM8K-style word problems with a calculator tool, for real models
  (envs/calculator.py).
- ``reasoning_gym``: any reasoning-gym task as a one-tool environment (envs/rgym.py).

The names and their import paths are ``streamrl.plugins.AGENT_ENVS``: config validation checks
a name there without importing the rollout fleet.
"""
