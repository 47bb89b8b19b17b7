"""OpenAI's Responses API (POST /v1/responses): its protocol, its events, the stored responses."""
