"""Anthropic's Messages API (POST /v1/messages), translated into chat completions."""
