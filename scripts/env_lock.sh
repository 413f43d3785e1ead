# Sourced by the *_env.sh scripts with the environment's folder: one build at a time per environment.
# A second run (the demo and the tests at once) waits here instead of removing the first one's
# half-built folder. The lock is held on descriptor 9 until the sourcing script exits.
mkdir -p "$(dirname "$1")"
if command -v flock >/dev/null; then
  exec 9>"$1.lock"
  flock 9
fi
