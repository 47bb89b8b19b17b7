"""POST /v1/chat/completions, and what turns a chat's text into a message: the reasoning
parser, tool calls and their parsers, structured outputs."""
