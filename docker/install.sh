#!/bin/sh
# Install the nsa-backend wheel from DIST_DIR next to the framework already in the environment
# (torch comes from the framework; nothing it pinned is upgraded). Used by both Dockerfiles and by
# the test that checks the images' install path.
#   docker/install.sh DIST_DIR [PYTHON]
set -eu
dist="$1"
python="${2:-python3}"
set -- "$dist"/nsa_backend-*.whl
if [ ! -f "$1" ]; then
    echo "install.sh: no nsa_backend wheel in $dist" >&2
    exit 1
fi
"$python" -m pip install --no-cache-dir --upgrade-strategy only-if-needed "$1"
"$python" -c "import nsa_backend, nsa_backend_integrations; print('nsa-backend', nsa_backend.__version__)"
