"""Training any agent: a user's async function talks to an OpenAI-compatible endpoint the rollout worker serves on its
engine, and the worker trains on the exact ids and log-probs of every call (``[environment] type = "agent"``).

- :mod:`rollout.agents.protocol`: the chat-completions wire form (requests checked, replies with tool calls).
- :mod:`rollout.agents.server`: the endpoint on the engine loop, one base URL per running episode, calls recorded.
- :mod:`rollout.agents.trajectory`: recorded calls -> training samples (split where a prompt does not extend).
- :mod:`rollout.agents.runner`: the agent function run per episode, with limits and timeouts.
"""

from rollout.agents.runner import AgentContext, AgentOutcome, AgentRunner, agent_metrics, load_agent_function

__all__ = ["AgentContext", "AgentOutcome", "AgentRunner", "agent_metrics", "load_agent_function"]
