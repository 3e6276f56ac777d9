#!/usr/bin/env bash
# Sets up the pinned environment (first run only) and trains FedAvg on the
# embedded synthetic CelebA-format data (offline). Outputs: runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m binaries.train --task=celeba_smile \
  --celeba_mode=federated --algorithm=fedavg --use_synthetic_data \
  --total_rounds=10 --clients_per_round=10 --client_steps=4 \
  --client_learning_rate=0.003 \
  --experiment_name=demo --root_output_dir=runs "$@"
