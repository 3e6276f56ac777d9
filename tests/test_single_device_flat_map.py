"""The group stream's flat_map: TF's elements, its function marked to be
instantiated without grappler (tff_algos/runtime/single_device_flat_map.py).
"""

import tensorflow as tf

from tff_algos.runtime import single_device_flat_map


def _clients(index):
  # A client pipeline as the tasks build one: shuffled with a seed, mapped,
  # batched, iterated twice (a shuffled dataset reshuffles). A Python seed:
  # a tensor seed fails to trace once another test has set a global seed.
  examples = tf.data.Dataset.range(index * 3 + 1).shuffle(
      8, seed=7, reshuffle_each_iteration=True).map(lambda x: x * 10)
  batches = examples.batch(2)
  return batches.concatenate(batches)


def _elements(make_flat_map):
  @tf.function(autograph=False)
  def stream():
    dataset = make_flat_map(tf.data.Dataset.range(4), _clients)
    iterator = iter(dataset)
    return [iterator.get_next() for _ in range(12)]
  return [t.numpy().tolist() for t in stream()]


def test_elements_equal_tf_flat_map():
  tf_flat_map = _elements(lambda d, f: d.flat_map(f))
  ours = _elements(single_device_flat_map.flat_map)
  assert ours == tf_flat_map
  # Eagerly as well, and the element spec.
  eager = single_device_flat_map.flat_map(tf.data.Dataset.range(4), _clients)
  expected = tf.data.Dataset.range(4).flat_map(_clients)
  assert eager.element_spec == expected.element_spec
  assert ([t.numpy().tolist() for t in eager] ==
          [t.numpy().tolist() for t in expected])


def _flat_map_function_attributes(make_flat_map):
  """The attributes of the function of the one FlatMapDataset op."""
  graph = tf.function(lambda: tf.data.experimental.to_variant(
      make_flat_map(tf.data.Dataset.range(4), _clients))
                      ).get_concrete_function().graph
  flat_maps = [op for op in graph.get_operations()
               if op.type == 'FlatMapDataset']
  assert len(flat_maps) == 1
  name = flat_maps[0].get_attr('f').name
  library = {f.signature.name: f for f in
             graph.as_graph_def().library.function}
  return library[name].attr


def test_the_function_is_marked_to_be_instantiated_as_written():
  attributes = _flat_map_function_attributes(single_device_flat_map.flat_map)
  assert attributes['experimental_ints_on_device'].b
  # TF's own flat_map is not (the mark is what differs).
  assert 'experimental_ints_on_device' not in _flat_map_function_attributes(
      lambda d, f: d.flat_map(f))
