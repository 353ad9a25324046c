"""Built-in agent environments, by the name ``rollout.agent`` takes.

- ``relay``: the toy multi-turn task a tiny random model learns on CPU (envs/relay.py).
- ``calculator``: GSM8K-style word problems with a calculator tool, for real models
  (envs/calculator.py).
- ``reasoning_gym``: any reasoning-gym task as a one-tool environment (envs/rgym.py).

Names map to import paths so that config validation can check a name without importing the
environments.
"""

BUILTIN_ENVS: dict[str, str] = {
    "relay": "streamrl.rollout_fleet.agent.envs.relay:RelayEnv",
    "calculator": "streamrl.rollout_fleet.agent.envs.calculator:CalculatorEnv",
    "reasoning_gym": "streamrl.rollout_fleet.agent.envs.rgym:ReasoningGymEnv",
}
