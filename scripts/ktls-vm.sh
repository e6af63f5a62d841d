#!/usr/bin/env bash
# Runs binx's kernel TLS path on a kernel that has it. The CI machine's
# kernel offers no TLS upper layer protocol (no tls module), so there binxd
# serves TLS with rustls and only that fallback is tested. This script boots
# Debian's cloud kernel (which ships tls.ko) under KVM with a small
# initramfs holding busybox, tls.ko and binx's binaries, and runs inside it
# the e2e TLS tests with kernel TLS required (BINX_TEST_EXPECT_KERNEL_TLS=1):
#
#   scripts/ktls-vm.sh test
#
# Needs Debian's package archive (it installs qemu-system-x86 and
# busybox-static, and downloads linux-image-cloud-amd64 into
# target/ktls-vm/). Prints the guest's console; exits with the guest
# command's status. About 15 seconds for `test` once things are built.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
mode="${1:-test}"
work="$root/target/ktls-vm"
mkdir -p "$work"

# Exit status 2: this machine cannot run the guest (nothing was tested).
cannot() {
  echo "ktls-vm: $*" >&2
  exit 2
}
# One setup at a time (parallel test runs share target/ktls-vm).
exec 9>"$work/setup.lock"
flock 9
need=()
command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
[ -x /bin/busybox ] || need+=(busybox-static)
if [ ${#need[@]} -gt 0 ]; then
  echo "ktls-vm: installing ${need[*]}" >&2
  install() { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >&2; }
  install || { apt-get update -qq >&2 && install; } || cannot "could not install ${need[*]}"
fi

# The guest kernel: the newest linux-image-*-cloud-amd64, unpacked once.
kernel_dir="$work/kernel"
if [ ! -d "$kernel_dir/boot" ]; then
  kernel_pkg() { apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}'; }
  pkg=$(kernel_pkg)
  [ -n "$pkg" ] || { apt-get update -qq >&2 && pkg=$(kernel_pkg); }
  [ -n "$pkg" ] || cannot "no linux-image-cloud-amd64 in the package archive"
  echo "ktls-vm: downloading $pkg" >&2
  (cd "$work" && apt-get download "$pkg" >&2) || cannot "could not download $pkg"
  mkdir -p "$kernel_dir.tmp"
  dpkg-deb -x "$work/${pkg}"_*.deb "$kernel_dir.tmp"
  mv "$kernel_dir.tmp" "$kernel_dir"
fi
flock -u 9
vmlinuz=$(ls "$kernel_dir"/boot/vmlinuz-* | head -1)
tls_ko=$(find "$kernel_dir/lib/modules" -name 'tls.ko*' | head -1)
[ -n "$tls_ko" ] || cannot "the guest kernel has no tls module"

# What runs in the guest.
case "$mode" in
  test)
    # The e2e test guest_kernel:: passes its own binaries.
    exe="${BINX_VM_E2E:-}"
    [ -n "$exe" ] || exe=$(cargo test --test e2e --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="e2e" and m.get("executable"): print(m["executable"])' | tail -1)
    bins=("$exe" "${BINX_VM_BINXD:-$root/target/debug/binxd}" "${BINX_VM_BINX:-$root/target/debug/binx}")
    guest_cmd="$exe tls:: --test-threads 1"
    memory=4096
    ;;
  *)
    echo "usage: scripts/ktls-vm.sh [test]" >&2
    exit 2
    ;;
esac
if [ -z "$exe" ]; then
  echo "ktls-vm: could not build the $mode binary" >&2
  exit 1
fi

# The initramfs: busybox, tls.ko, the binaries at their own paths (they
# name each other by absolute path) and the shared libraries they load.
run=$(mktemp -d "$work/run.XXXXXX")
trap 'rm -rf "$run"' EXIT
rootfs="$run/rootfs"
mkdir -p "$rootfs"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,etc}
cp /bin/busybox "$rootfs/bin/busybox"
# tls.ko and the crypto modules it asks the kernel for (gcm(aes), ...).
kver=$(basename "$(dirname "$(dirname "$(dirname "$(dirname "$tls_ko")")")")")
mods="$kernel_dir/lib/modules/$kver"
for dir in kernel/net/tls kernel/crypto kernel/arch/x86/crypto kernel/lib/crypto; do
  if [ -d "$mods/$dir" ]; then
    mkdir -p "$rootfs/lib/modules/$kver/$dir"
    cp -r "$mods/$dir/." "$rootfs/lib/modules/$kver/$dir/"
  fi
done
cp "$mods"/modules.builtin "$mods"/modules.order "$rootfs/lib/modules/$kver/"
busybox depmod -b "$rootfs" "$kver"
for bin in "${bins[@]}"; do
  mkdir -p "$rootfs$(dirname "$bin")"
  strip -o "$rootfs$bin" "$bin"
  for lib in $(ldd "$bin" | awk '/=>/ {print $3} /^\t\// {print $1}'); do
    mkdir -p "$rootfs$(dirname "$lib")"
    cp -L "$lib" "$rootfs$lib"
  done
done
mkdir -p "$rootfs$root/target/criterion"
echo "127.0.0.1 localhost" >"$rootfs/etc/hosts"
cat >"$rootfs/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# /tmp stays the initramfs' own (it is in memory already): a tmpfs over it
# would hide binaries whose paths are under /tmp (a clone in /tmp).
chmod 1777 /tmp
ip link set lo up
modprobe tls
for m in aesni_intel ghash_clmulni_intel gcm chacha20poly1305; do modprobe \$m 2>/dev/null; done
echo "ktls-vm: kernel \$(uname -r), ULPs: \$(cat /proc/sys/net/ipv4/tcp_available_ulp)"
export PATH=/bin HOME=/tmp TMPDIR=/tmp BINX_TEST_EXPECT_KERNEL_TLS=1 RUST_BACKTRACE=1
cd $root
$guest_cmd
echo "ktls-vm: exit \$?"
poweroff -f
EOF
chmod +x "$rootfs/init"
(cd "$rootfs" && find . | busybox cpio -o -H newc 2>/dev/null | gzip -1 >"$run/initramfs.gz")

# TCG (emulation) by default: the nested KVM of CI's VMs does not boot this
# kernel (it hides SSE4 and AES-NI from the guest's CPUID). Emulation is
# right for a test and useless for timing; BINX_VM_ACCEL=kvm uses KVM where
# it works.
case "${BINX_VM_ACCEL:-tcg}" in
  kvm) accel="-enable-kvm -cpu host" ;;
  *) accel="-accel tcg -cpu max" ;;
esac
log="$run/console.log"
timeout 900 qemu-system-x86_64 $accel -smp 2 -m "$memory" \
  -kernel "$vmlinuz" -initrd "$run/initramfs.gz" \
  -append "console=ttyS0 quiet panic=-1 rdinit=/init" \
  -nographic -no-reboot -nic none | tee "$log"
status=$(sed -n 's/.*ktls-vm: exit \([0-9]*\).*/\1/p' "$log" | tail -1)
if [ -z "$status" ]; then
  echo "ktls-vm: the guest did not finish its command" >&2
  exit 1
fi
exit "$status"
