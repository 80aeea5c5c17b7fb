# Sourced by scripts/*.sh: create .venv if needed and install shmdisagg (editable, with the
# native extension and the test extra). Idempotent: a second run only rebuilds the extension.
VENV="${SHMDISAGG_VENV:-$PWD/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# setuptools >= 77 reads pyproject's SPDX license and builds the extension in place without
# warnings (a venv starts with Python's bundled, older one).
if ! "$VENV/bin/python" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --upgrade pip "setuptools>=77"
fi
if ! "$VENV/bin/python" -c "import shmdisagg._native, pytest, xdist, prometheus_client, matplotlib, opentelemetry.sdk, opentelemetry.exporter.otlp.proto.http, ruff, mypy, aetcd" 2>/dev/null; then
  # the first run's only output otherwise is pip's own (which can be minutes of warnings)
  echo "setup_env.sh: installing shmdisagg and its test tools into $VENV (first run: a minute or two)" >&2
  "$VENV/bin/python" -m pip install -q -e ".[test]"
else
  # Keep the extension in step with native/ when the sources changed.
  "$VENV/bin/python" setup.py -q build_ext --inplace >/dev/null
fi
# disagg_cluster on etcd:// is tested against a real etcd (tests/integration/etcd.py): Debian's
# etcd-server and etcd-client packages (etcd 3.4). Installed here when missing and we are root.
if ! command -v etcd >/dev/null 2>&1 || ! command -v etcdctl >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client; } \
      >/dev/null 2>&1 || echo "setup_env.sh: apt-get install etcd-server etcd-client failed: the etcd tests will fail" >&2
  else
    echo "setup_env.sh: etcd is not installed (apt-get install etcd-server etcd-client): the etcd tests will fail" >&2
  fi
fi
export VENV
