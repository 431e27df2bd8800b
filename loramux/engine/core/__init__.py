"""The engine's core: a request's sequences, the scheduler and the KV blocks, the step's typed
outputs, detokenizing and structured output, and what the engine reports."""
