"""Models for the example binaries: a small MLP, a small CNN, a wide CNN of
about 2.1 M parameters (8.5 MB of float32 to average: a model whose
averaging a 100 Mbit/s link feels, and whose steps are real compute), and a
byte-level transformer language model for text (`transformer_lm`)."""

import math

MODELS = ("mlp", "cnn", "wide_cnn", "transformer_lm")
TEXT_MODELS = ("transformer_lm",)


def build(name, input_shape, num_classes, **sizes):
  """An uncompiled Keras model `name` for inputs of `input_shape`;
  `sizes`: transformer_lm's d_model, num_layers, num_heads."""
  import keras  # pylint: disable=g-import-not-at-top
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}.")
  if name in ("cnn", "wide_cnn") and len(input_shape) != 3:
    raise ValueError(f"--model={name} needs an image data set (height, width, "
                     f"channels); this one has inputs of shape {input_shape}. "
                     "Use --model=mlp.")
  if name == "transformer_lm":
    if len(input_shape) != 1 or num_classes != 256:
      raise ValueError("--model=transformer_lm needs a byte-level text data "
                       "set (--dataset=stdlib_text).")
    return transformer_lm(seq_len=input_shape[0], **sizes)
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


def transformer_lm(seq_len=64, d_model=64, num_layers=2, num_heads=4,
                   mlp_ratio=4, dropout=0.0, keras_module=None):
  """A decoder-only transformer over bytes: logits of the next byte.

  Inputs: int32 bytes (batch, seq_len); outputs: logits (batch, seq_len,
  256), position t's from bytes 0..t alone (causal self-attention). Token
  and learned position embeddings, `num_layers` pre-LayerNorm blocks
  (causal MultiHeadAttention, then an MLP of mlp_ratio * d_model GELU
  units, each added back), a final LayerNorm and Dense(256). Only layers
  both Keras flavours have: `keras_module` may be `tf_keras` (default:
  `keras`, Keras 3).

  The defaults (137,216 parameters, 0.55 MB of float32) fit a 2-core
  machine: one training step on a batch of 32 windows of 64 bytes took
  about 26 ms there (Keras 3 or tf_keras, Adam, `fit` on stdlib_text; TF
  2.21 on CPU, the machine shared), and 220 such steps brought validation
  to about 3.6 bits per byte (8: random guessing).
  """
  keras = keras_module
  if keras is None:
    import keras  # pylint: disable=g-import-not-at-top,redefined-outer-name
  if d_model % num_heads:
    raise ValueError(f"d_model {d_model} is not a multiple of num_heads "
                     f"{num_heads}.")
  layers = keras.layers
  inputs = keras.Input((seq_len,), dtype="int32")
  h = layers.Embedding(256, d_model, name="tokens")(inputs)
  h = _position_embedding(keras, seq_len, d_model)(h)
  for i in range(num_layers):
    a = layers.LayerNormalization(epsilon=1e-5, name=f"ln_attn_{i}")(h)
    a = layers.MultiHeadAttention(num_heads, d_model // num_heads,
                                  dropout=dropout, name=f"attention_{i}")(
                                      a, a, use_causal_mask=True)
    h = layers.Add()([h, layers.Dropout(dropout)(a)])
    m = layers.LayerNormalization(epsilon=1e-5, name=f"ln_mlp_{i}")(h)
    m = layers.Dense(mlp_ratio * d_model, activation="gelu",
                     name=f"mlp_in_{i}")(m)
    m = layers.Dense(d_model, name=f"mlp_out_{i}")(m)
    h = layers.Add()([h, layers.Dropout(dropout)(m)])
  h = layers.LayerNormalization(epsilon=1e-5, name="ln_final")(h)
  logits = layers.Dense(256, name="logits")(h)
  return keras.Model(inputs, logits, name="transformer_lm")


def _position_embedding(keras, seq_len, d_model):
  """A layer adding a learned (seq_len, d_model) table to its input: a
  Layer subclass, since neither flavour has one that works in both."""

  class PositionEmbedding(keras.layers.Layer):

    def build(self, input_shape):
      del input_shape
      self.table = self.add_weight(
          name="table", shape=(seq_len, d_model),
          initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
      return x + self.table

  return PositionEmbedding(name="positions")


def bits_per_byte(y_true, y_pred):
  """A metric for compile(metrics=[...]) in either Keras flavour: the
  cross-entropy of next-byte logits in bits (nats / ln 2); its mean over a
  set is the loss (SparseCategoricalCrossentropy(from_logits=True)) /
  ln 2."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  nats = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.cast(y_true, tf.int32), logits=tf.cast(y_pred, tf.float32))
  return nats / math.log(2)
