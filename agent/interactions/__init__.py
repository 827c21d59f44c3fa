"""Interactions: simulated users that answer the model between assistant turns (BaseInteraction),
the interaction.yaml loader, and the built-in GSM8K tutor."""

from agent.interactions.base import BaseInteraction
from agent.interactions.registry import InteractionConfigError, build_interactions, load_interactions

__all__ = ["BaseInteraction", "InteractionConfigError", "build_interactions", "load_interactions"]
