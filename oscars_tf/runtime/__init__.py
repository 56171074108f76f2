"""TensorFlow runtime: the server and coordination service, the averaging
collectives."""
