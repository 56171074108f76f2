"""Block quantization of float32 vectors to 8 or 4 bits, packed in int32.

A vector is cut into blocks of `BLOCK` values; each block is sent as one
float32 scale (its largest magnitude over the largest level) and one signed
integer per value, rounded to the nearest level: at most half a step off,
`|x - dequantize(quantize(x))| <= max|block| / (2 * levels)`. TensorFlow's
collectives take no 8-bit type (`CollectiveGatherV2` and
`CollectiveAllToAllV2` take float, half, double, int32 and int64), so the
integers travel packed four (int8) or eight (int4) to an int32 word, and the
scales as the bits of their float32 in int32 words after them: one buffer,
one collective.

Error feedback (Seide et al. 2014; Karimireddy et al., "Error Feedback
Fixes SignSGD", ICML 2019) is the caller's: it keeps `x -
dequantize(quantize(x))` and adds it to what it sends next, so nothing
rounding loses is lost for good.

Example:
  q, scales = quantize(x, bits=4)            # x: float32 [n], n % 64 == 0
  words = pack(q[None], scales[None], bits=4)  # [1, n // 8 + n // 64]
  q, scales = unpack(words, n, bits=4)
  x_hat = dequantize(q, scales)
"""

import tensorflow as tf

# Compressions `OscarsStrategy(compression=)` takes, by their bits a value.
BITS = {"int8": 8, "int4": 4}
# Values a scale: 64 float32 values (256 bytes) travel as 64 bytes + 4
# (int8) or 32 + 4 (int4), 1/3.8 and 1/7.1 of float32.
BLOCK = 64


def levels(bits):
  """The largest level of a signed `bits`-bit value: 127 or 7 (the level
  -128 or -8 is unused: symmetric around 0)."""
  return 2 ** (bits - 1) - 1


def quantize(x, bits, block=BLOCK):
  """(levels as int32, scales as float32) of float32 `x`, whose length is
  a multiple of `block`. A block of zeros has scale 0."""
  blocks = tf.reshape(x, [-1, block])
  scales = tf.reduce_max(tf.abs(blocks), axis=1) / levels(bits)
  safe = tf.where(scales > 0, scales, tf.ones_like(scales))
  q = tf.clip_by_value(tf.round(blocks / safe[:, None]), -levels(bits),
                       levels(bits))
  return tf.reshape(tf.cast(q, tf.int32), [-1]), scales


def dequantize(q, scales, block=BLOCK):
  """The float32 values `quantize` gave `q` and `scales` of."""
  blocks = tf.cast(tf.reshape(q, [-1, block]), tf.float32)
  return tf.reshape(blocks * scales[:, None], [-1])


def words_of(length, bits, block=BLOCK):
  """int32 words `pack` makes of a row of `length` values (a multiple of
  `block`, and of 8): the levels, then one word a scale."""
  return length * bits // 32 + length // block


def pack(q, scales, bits):
  """Rows of `quantize`'s levels `q` [rows, n] and their `scales`
  [rows, n / block] as int32 words [rows, words_of(n, bits)]: each row its
  levels, then its scales."""
  rows = tf.shape(q)[0]
  if bits == 8:
    payload = tf.bitcast(tf.reshape(tf.cast(q, tf.int8), [rows, -1, 4]),
                         tf.int32)
  else:  # two levels a byte: offset by 8 into 1..15, low nibble first
    pairs = tf.reshape(q + 8, [rows, -1, 2])
    nibbles = tf.cast(pairs[..., 0] + 16 * pairs[..., 1], tf.uint8)
    payload = tf.bitcast(tf.reshape(nibbles, [rows, -1, 4]), tf.int32)
  return tf.concat([payload, tf.bitcast(scales, tf.int32)], 1)


def unpack(words, length, bits):
  """(levels [rows, length], scales [rows, length / block]) of `pack`'s
  rows of `length` values each (`length` may be a tensor)."""
  rows = tf.shape(words)[0]
  payload_words = length * bits // 32
  payload, scale_words = (words[:, :payload_words],
                          words[:, payload_words:])
  if bits == 8:
    q = tf.cast(tf.reshape(tf.bitcast(payload, tf.int8), [rows, -1]),
                tf.int32)
  else:
    nibbles = tf.cast(tf.reshape(tf.bitcast(payload, tf.uint8), [rows, -1]),
                      tf.int32)
    q = tf.reshape(tf.stack([nibbles % 16, nibbles // 16], axis=2) - 8,
                   [rows, -1])
  return q, tf.bitcast(scale_words, tf.float32)
