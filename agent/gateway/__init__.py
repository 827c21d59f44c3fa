"""An OpenAI-compatible endpoint over the bus that records every session token-exactly."""

from agent.gateway.server import Gateway
from agent.gateway.requests import RequestError
from agent.gateway.session import Conversation, Segment

__all__ = ["Conversation", "Gateway", "RequestError", "Segment"]
