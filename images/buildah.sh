# Sourced by images/build.sh and images/smoke.sh: the buildah command line both use.
# Storage under IMAGES_CACHE (kept between runs: the layer cache, the debootstrap rootfs), apart
# from any other buildah storage on the machine. The overlay driver where the kernel lets buildah
# mount it (each layer a diff), else vfs (each layer a full copy: slower, works everywhere).
IMAGES_CACHE=${IMAGES_CACHE:-/var/cache/kvfleet-images}
if [ -z "${BUILDAH:-}" ]; then
  if [ -z "${STORAGE_DRIVER:-}" ]; then
    if [ -f "$IMAGES_CACHE/storage-driver" ]; then
      STORAGE_DRIVER=$(cat "$IMAGES_CACHE/storage-driver")
    else
      mkdir -p "$IMAGES_CACHE"
      probe=(buildah --storage-driver overlay --root "$IMAGES_CACHE/probe" --runroot "$IMAGES_CACHE/probe-run")
      STORAGE_DRIVER=vfs
      if c=$(timeout 60 "${probe[@]}" from scratch 2>/dev/null) && timeout 60 "${probe[@]}" mount "$c" >/dev/null 2>&1; then
        STORAGE_DRIVER=overlay
      fi
      [ -z "${c:-}" ] || timeout 60 "${probe[@]}" rm "$c" >/dev/null 2>&1 || true
      rm -rf "$IMAGES_CACHE/probe" "$IMAGES_CACHE/probe-run"
      echo "$STORAGE_DRIVER" >"$IMAGES_CACHE/storage-driver"
    fi
  fi
  BUILDAH="buildah --storage-driver $STORAGE_DRIVER --root $IMAGES_CACHE/storage-$STORAGE_DRIVER --runroot $IMAGES_CACHE/run-$STORAGE_DRIVER"
fi
