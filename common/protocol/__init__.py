"""The wire protocol: frames, messages, the client connection and CURVE keys (docs/protocol.md)."""
