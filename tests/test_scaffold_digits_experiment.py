"""experiments/scaffold_digits.py's verdicts on given train losses (no training)."""

import argparse

from experiments import scaffold_digits


def _args(steps, learning_rates):
  return argparse.Namespace(client_steps=steps, learning_rates=learning_rates)


def _rows(losses):
  """{(algorithm, K, eta): loss} -> the rows `summarize` returns."""
  return {key: dict(loss=loss) for key, loss in losses.items()}


def test_claims_hold_when_fedavg_worsens_and_scaffold_does_not(capsys):
  losses = {('fedavg', 5, 0.1): 0.9, ('fedavg', 25, 0.1): 1.1,
            ('scaffold', 5, 0.1): 0.8, ('scaffold', 25, 0.1): 0.7,
            ('fedavg', 5, 0.3): 1.0, ('fedavg', 25, 0.3): 1.5,
            ('scaffold', 5, 0.3): 0.75, ('scaffold', 25, 0.3): 0.76}
  assert scaffold_digits.check_claims(_rows(losses), _args([5, 25],
                                                           [0.1, 0.3]))
  out = capsys.readouterr().out
  assert ('FedAvg worse as K grows: holds; SCAFFOLD not worse as K grows: '
          'holds') in out
  # The per-step view: at eta 0.3 SCAFFOLD got worse (0.75 -> 0.76).
  assert ('eta 0.3: FedAvg 1.0000 1.5000 worse as K grows: holds; SCAFFOLD '
          '0.7500 0.7600 not worse: does NOT hold') in out


def test_claim_two_fails_when_fedavg_improves_with_k(capsys):
  losses = {('fedavg', 5, 1.0): 0.39, ('fedavg', 25, 1.0): 0.36,
            ('scaffold', 5, 1.0): 0.16, ('scaffold', 25, 1.0): 0.12}
  assert not scaffold_digits.check_claims(_rows(losses), _args([5, 25], [1.0]))
  assert 'FedAvg worse as K grows: does NOT hold' in capsys.readouterr().out


def test_claim_one_fails_when_fedavg_is_lower_at_some_k():
  losses = {('fedavg', 5, 1.0): 0.3, ('scaffold', 5, 1.0): 0.4}
  assert not scaffold_digits.check_claims(_rows(losses), _args([5], [1.0]))


def test_summarize_refuses_runs_with_fewer_rounds_than_total_rounds(tmp_path):
  # An interrupted experiment's runs: one without a row was an IndexError
  # traceback, one cut short was judged as if it had its --total_rounds.
  import pytest  # pylint: disable=g-import-not-at-top
  from pipeline.errors import UsageError  # pylint: disable=g-import-not-at-top
  args = argparse.Namespace(client_steps=[5], learning_rates=[0.3],
                            root_output_dir=str(tmp_path), total_rounds=3,
                            target_loss=0.5)
  for rounds in (0, 2):
    for algorithm in scaffold_digits.ALGORITHMS:
      run_dir = tmp_path / scaffold_digits.run_name(algorithm, 5, 0.3)
      run_dir.mkdir(exist_ok=True)
      (run_dir / 'metrics.csv').write_text(
          'round_num,eval/accuracy,eval_train/loss\n' +
          ''.join(f'{r},0.5,1.0\n' for r in range(1, rounds + 1)))
    with pytest.raises(UsageError, match=(
        rf'^{tmp_path}/fedavg_K5_lr0.3 has {rounds} rounds, fewer than the 3 '
        r'summarized \(--total_rounds\); train it first')):
      scaffold_digits.summarize(args)
  args.total_rounds = 2
  assert scaffold_digits.summarize(args)['scaffold', 5, 0.3] == dict(
      loss=1.0, accuracy=0.5, reached=None, rounds=2)
