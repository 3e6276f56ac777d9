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
