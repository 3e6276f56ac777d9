"""VGG-11 and ResNet-8 for 32x32 images, as FedPVR ([FedPVR]) uses them.

Both follow the FedDF code the paper takes its models from (digest 3.3):
- VGG-11 (config "A", no normalization): eight conv3x3+ReLU layers
  [64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M] and the head
  Dropout(0.5), Dense(512), ReLU, Dropout(0.5), Dense(512), ReLU, Dense(C):
  22 variables, the last six being the three dense layers.
- ResNet-8 (CIFAR ResNet of depth 6n+2, n=1, basic blocks 16-32-64): 29
  variables, the last two being the classifier.
  Normalization is GroupNorm with 2 groups, as in the released FedPVR code,
  not BatchNorm: batch statistics would be non-trainable state averaged
  across clients, which the paper names as the cause of ResNet-8's slower
  convergence.

Initialization follows PyTorch as FedDF does: conv kernels
N(0, 2 / (9 * out_channels)) with zero bias, dense layers uniform in
+-1/sqrt(fan_in) (PyTorch's default). `width` scales every layer width so
tests can build tiny versions; width=1 gives the paper's sizes.
"""

import math

import tensorflow as tf

VGG11_LAYERS = (64, 'M', 128, 'M', 256, 256, 'M', 512, 512, 'M', 512, 512,
                'M')
VGG11_HIDDEN_UNITS = 512
RESNET8_WIDTHS = (16, 32, 64)
GROUP_NORM_GROUPS = 2
IMAGE_SHAPE = (32, 32, 3)


def _scaled(channels: int, width: float, multiple: int = 1) -> int:
  return max(multiple, multiple * round(channels * width / multiple))


def _conv_init(kernel_size: int, filters: int):
  return tf.keras.initializers.RandomNormal(
      stddev=math.sqrt(2.0 / (kernel_size * kernel_size * filters)))


def _dense(units: int, fan_in: int, **kwargs) -> tf.keras.layers.Dense:
  """A dense layer with PyTorch's default initialization."""
  bound = 1.0 / math.sqrt(fan_in)
  return tf.keras.layers.Dense(
      units,
      kernel_initializer=tf.keras.initializers.VarianceScaling(
          scale=1.0 / 3.0, mode='fan_in', distribution='uniform'),
      bias_initializer=tf.keras.initializers.RandomUniform(-bound, bound),
      **kwargs)


def vgg11(num_classes: int, width: float = 1.0,
          dropout: float = 0.5) -> tf.keras.Model:
  inputs = tf.keras.Input(IMAGE_SHAPE)
  x = inputs
  for layer in VGG11_LAYERS:
    if layer == 'M':
      x = tf.keras.layers.MaxPool2D(2, 2)(x)
    else:
      filters = _scaled(layer, width)
      x = tf.keras.layers.Conv2D(
          filters, 3, padding='same', activation='relu',
          kernel_initializer=_conv_init(3, filters),
          bias_initializer='zeros')(x)
  x = tf.keras.layers.Flatten()(x)
  hidden = _scaled(VGG11_HIDDEN_UNITS, width)
  fan_in = x.shape[-1]
  for _ in range(2):
    x = tf.keras.layers.Dropout(dropout)(x)
    x = _dense(hidden, fan_in, activation='relu')(x)
    fan_in = hidden
  outputs = _dense(num_classes, fan_in)(x)
  return tf.keras.Model(inputs, outputs, name='vgg11')


def _group_norm() -> tf.keras.layers.Layer:
  return tf.keras.layers.GroupNormalization(groups=GROUP_NORM_GROUPS,
                                            epsilon=1e-5)


def _conv(filters: int, kernel_size: int, stride: int = 1):
  return tf.keras.layers.Conv2D(
      filters, kernel_size, strides=stride, padding='same', use_bias=False,
      kernel_initializer=_conv_init(kernel_size, filters))


class BasicBlock(tf.keras.layers.Layer):
  """conv-norm-relu-conv-norm plus shortcut, then relu.

  A layer of its own so its variables come in PyTorch's order (conv1, norm1,
  conv2, norm2, shortcut conv, shortcut norm): variable indices then match
  the paper's (e.g. the ResNet-8 classifier is variables 27-28).
  """

  def __init__(self, filters: int, stride: int, **kwargs):
    super().__init__(**kwargs)
    self.filters = filters
    self.stride = stride
    self.conv1 = _conv(filters, 3, stride)
    self.norm1 = _group_norm()
    self.conv2 = _conv(filters, 3)
    self.norm2 = _group_norm()
    self.shortcut_conv = None
    self.shortcut_norm = None

  def build(self, input_shape):
    if self.stride != 1 or input_shape[-1] != self.filters:
      # The strided 1x1 conv as a 1x1 conv of every stride-th pixel (the
      # same function: 'same' padding adds none for a 1x1 kernel). TF 2.14's
      # oneDNN kernel for the filter gradient of a strided 1x1 conv corrupts
      # memory when it has fewer than 16 input channels (--model_width
      # below 1): a segmentation fault or a glibc abort.
      self.shortcut_conv = _conv(self.filters, 1)
      self.shortcut_norm = _group_norm()
    super().build(input_shape)

  def call(self, inputs):
    x = tf.nn.relu(self.norm1(self.conv1(inputs)))
    x = self.norm2(self.conv2(x))
    shortcut = inputs
    if self.shortcut_conv is not None:
      strided = inputs[:, ::self.stride, ::self.stride, :]
      shortcut = self.shortcut_norm(self.shortcut_conv(strided))
    return tf.nn.relu(x + shortcut)

  def get_config(self):
    return {**super().get_config(), 'filters': self.filters,
            'stride': self.stride}


def resnet8(num_classes: int, width: float = 1.0) -> tf.keras.Model:
  widths = [_scaled(w, width, GROUP_NORM_GROUPS) for w in RESNET8_WIDTHS]
  inputs = tf.keras.Input(IMAGE_SHAPE)
  x = tf.keras.layers.ReLU()(_group_norm()(_conv(widths[0], 3)(inputs)))
  for filters, stride in zip(widths, (1, 2, 2)):
    x = BasicBlock(filters, stride)(x)
  x = tf.keras.layers.GlobalAveragePooling2D()(x)
  outputs = _dense(num_classes, widths[-1])(x)
  return tf.keras.Model(inputs, outputs, name='resnet8')


MODELS = {'vgg11': vgg11, 'resnet8': resnet8}
