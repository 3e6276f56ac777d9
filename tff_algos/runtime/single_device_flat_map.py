"""`Dataset.flat_map` whose function TF instantiates without grappler.

Making an iterator over a `flat_map` instantiates its function. TF (2.14)
instantiates a tf.data function as a multi-device function, and runs
grappler over it at every instantiation, unless the function is marked
`experimental_ints_on_device` (tensorflow/core/data/captured_function.cc:
such a function runs on the iterator's device alone, and is instantiated as
written). A group's stream (`cohort.group_stream`) is one `flat_map` whose
function builds each client's pipeline, and its iterator is made once per
group and round: with grappler that cost 35-63 ms a group here (TF's
profiler, `MakeIterator::FlatMapDataset`), most of a small model's round.
tf.data functions run on the CPU anyway (on a GPU host as well): the mark
changes where nothing runs, only how the function is instantiated, and the
function's ops are the ones traced.

`Dataset.flat_map` takes no function attributes, so this builds the same
dataset op as TF's `_FlatMapDataset` with that one attribute; TF's private
modules are used here only, for the pinned TF version.
"""

import tensorflow as tf

SUPPORTED_VERSION = '2.14.1'
if tf.__version__ != SUPPORTED_VERSION:
  raise ImportError(
      f'{__name__} builds a tf.data op from TF {SUPPORTED_VERSION}\'s private '
      f'modules; found TF {tf.__version__}')

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
from tensorflow.python.data.ops import dataset_ops
from tensorflow.python.data.ops import structured_function
from tensorflow.python.ops import gen_dataset_ops
# pylint: enable=g-import-not-at-top,g-bad-import-order,wrong-import-position

# FunctionLibraryDefinition::kIntsOnDeviceAttr.
INSTANTIATED_AS_WRITTEN = {'experimental_ints_on_device': True}


class _FlatMapDataset(dataset_ops.UnaryDataset):
  """TF's `_FlatMapDataset` (tensorflow/python/data/ops/flat_map_op.py), its
  function traced with `INSTANTIATED_AS_WRITTEN`."""

  def __init__(self, input_dataset, map_func):
    self._input_dataset = input_dataset
    self._map_func = structured_function.StructuredFunctionWrapper(
        map_func, 'Dataset.flat_map()', dataset=input_dataset,
        defun_kwargs=dict(INSTANTIATED_AS_WRITTEN))
    if not isinstance(self._map_func.output_structure,
                      dataset_ops.DatasetSpec):
      raise TypeError('the flat_map function must return a tf.data.Dataset')
    # pylint: disable=protected-access
    self._structure = self._map_func.output_structure._element_spec
    self._name = None  # Read by `_common_args`.
    variant_tensor = gen_dataset_ops.flat_map_dataset(
        input_dataset._variant_tensor,
        self._map_func.function.captured_inputs,
        f=self._map_func.function,
        **self._common_args)
    # pylint: enable=protected-access
    super().__init__(input_dataset, variant_tensor)

  def _functions(self):
    return [self._map_func]

  @property
  def element_spec(self):
    return self._structure


def flat_map(dataset: tf.data.Dataset, map_func) -> tf.data.Dataset:
  """`dataset.flat_map(map_func)`, its function instantiated without
  grappler."""
  return _FlatMapDataset(dataset, map_func)
