"""Protocol: membership, the rate table, agreed numbers, group keys.

No TensorFlow; testable over an in-memory store."""
