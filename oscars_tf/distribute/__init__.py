"""Strategy glue: OscarsStrategy and its extended, the rounds in the graph,
epochs, start-up, outer momentum."""
