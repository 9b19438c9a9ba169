#!/usr/bin/env bash
# `make test-compat`: the focused compatibility subset against other transformers releases, each in its own
# virtualenv (.venv-compat/<version>). HF_PAGED_TRANSFORMERS="5.21.1 5.22.0" picks the releases (default: the
# floor, the last release before 5.24's API rename, and the last before 5.25's recurrent-cache changes, see
# hf_paged/compat.py TESTED_RANGE).
#   usage: tests/compat/run.sh PYTHON VERSION...
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${1:?usage: run.sh PYTHON VERSION...}; shift
SUBSET=(
  tests/test_compat.py                                   # private names, keyword, layers
  tests/test_generate_core.py                            # parity with DynamicCache, second turn
  tests/test_sharing.py                                  # forks, beams, samples, KVPool prefix hits
  tests/test_reliability_generate.py                     # exhaustion, interruption, threads
  tests/test_demo.py                                     # the demo
  tests/test_trust.py                                    # padding, static caches, crops, output_attentions
  tests/test_hybrid.py::test_assisted_decoding_refused_before_5_25  # before 5.25: recurrent states cannot crop
  "tests/test_matrix_models.py::test_greedy_left_padded[llama]"
  "tests/test_matrix_models.py::test_greedy_left_padded[mistral]"
  "tests/test_matrix_models.py::test_greedy_left_padded[qwen2]"
  "tests/test_matrix_models.py::test_greedy_left_padded[gemma2]"
  "tests/test_matrix_models.py::test_greedy_left_padded[gpt2]"
  "tests/test_matrix_models.py::test_sampling[phi3]"
  "tests/test_matrix_models.py::test_layers_reusing_kv_attend_over_the_earlier_layers_blocks[gemma4_text]"  # model code differs by release
  "tests/test_vlm.py::test_vlm_generate_equals_dynamic_cache_with_an_image[gemma3]"  # image masks differ by release
  "tests/test_vlm.py::test_a_left_padded_batch_with_bidirectional_images_equals_dynamic_cache[gemma3]"
)
status=0
for version in "$@"; do
  venv=.venv-compat/$version
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import transformers, sys; sys.exit(transformers.__version__ != '$version')" 2>/dev/null; then
    echo "== creating $venv"
    rm -rf "$venv"; "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q torch==2.13.0               # first: a bare torch requirement pulls a multi-GB build
    "$venv/bin/pip" install -q -e ".[test]" "transformers==$version"
  fi
  echo "== transformers $version"
  if ! "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup "${SUBSET[@]}"; then
    echo "== FAILED against transformers $version"; status=1
  fi
done
exit $status
