"""Test-process setup: two logical CPU devices, quiet TensorFlow logs.

Logical devices must be configured before TensorFlow's runtime starts, so it
happens here, before any test module runs an op.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.pop("TF_CONFIG", None)

import tensorflow as tf  # pylint: disable=g-import-not-at-top

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
