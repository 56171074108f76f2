"""Policy: table in, plan out. Pure Python, no TensorFlow."""
