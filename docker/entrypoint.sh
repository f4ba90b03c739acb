#!/bin/sh
# Print what nsa-backend found (GPU, arch, native packages, the route of every op) before serving,
# so a bad setup is visible in the first lines of the container log. NSA_BACKEND_DOCTOR=0 skips it.
set -e
if [ "${NSA_BACKEND_DOCTOR:-1}" != "0" ]; then
    nsa-backend doctor || echo "nsa-backend: doctor reported problems (serving anyway)" >&2
fi
exec "$@"
