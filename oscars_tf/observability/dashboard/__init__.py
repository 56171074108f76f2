"""The `oscars` TensorBoard dashboard (a plugin served by stock TensorBoard)."""
