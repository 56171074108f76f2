"""Models for the example binaries: a small MLP and a small CNN."""

MODELS = ("mlp", "cnn")


def build(name, input_shape, num_classes):
  """An uncompiled Keras model `name` for inputs of `input_shape`."""
  import keras  # pylint: disable=g-import-not-at-top
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}.")
  if name == "cnn" and len(input_shape) != 3:
    raise ValueError(f"--model=cnn needs an image data set (height, width, "
                     f"channels); this one has inputs of shape {input_shape}. "
                     "Use --model=mlp.")
  inputs = keras.Input(input_shape)
  if name == "mlp":
    h = keras.layers.Flatten()(inputs)
    h = keras.layers.Dense(128, activation="relu")(h)
    h = keras.layers.Dense(64, activation="relu")(h)
  else:
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    if min(input_shape[:2]) >= 16:  # 8x8 digits stay full size
      h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(h), name=name)
