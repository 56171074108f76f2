"""Models for the example binaries: a small MLP, a small CNN, and a wide
CNN of about 2.1 M parameters (8.5 MB of float32 to average: a model whose
averaging a 100 Mbit/s link feels, and whose steps are real compute)."""

MODELS = ("mlp", "cnn", "wide_cnn")


def build(name, input_shape, num_classes):
  """An uncompiled Keras model `name` for inputs of `input_shape`."""
  import keras  # pylint: disable=g-import-not-at-top
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}.")
  if name in ("cnn", "wide_cnn") and len(input_shape) != 3:
    raise ValueError(f"--model={name} needs an image data set (height, width, "
                     f"channels); this one has inputs of shape {input_shape}. "
                     "Use --model=mlp.")
  inputs = keras.Input(input_shape)
  if name == "mlp":
    h = keras.layers.Flatten()(inputs)
    h = keras.layers.Dense(128, activation="relu")(h)
    h = keras.layers.Dense(64, activation="relu")(h)
  elif name == "wide_cnn":
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = keras.layers.Flatten()(h)  # 8x8 digits: 4,096 features
    h = keras.layers.Dense(512, activation="relu")(h)
  else:
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    if min(input_shape[:2]) >= 16:  # 8x8 digits stay full size
      h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(h), name=name)
