"""The delivery log: what the listener received and decided, kept in Redis for
inspection and replay, and its text form."""
