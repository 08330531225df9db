# Sourced by the set-up scripts (scripts/setup-venv.sh, scripts/vllm-env.sh):
#   pip_steps PYTHON PIP-INSTALL-ARGS...
# runs `PYTHON -m pip install ARGS` and prints, under the step's own line, one line a package
# it fetches (its file and size: `Downloading torch-2.13.0-....whl (200.1 MB)`, `Using cached
# ...`, `Processing ...` for local files), pip's `Successfully installed NAME-VERSION ...`, and
# how many requirements were there already: what a person waiting wants to see, without pip's
# metadata fetches, progress bars and already-satisfied lines that would bury a CI log. pip's
# warnings and errors (stderr) pass through as they are; the exit status is pip's.
pip_steps() {
    local python="$1"
    shift
    "$python" -m pip install --progress-bar off --disable-pip-version-check --no-input "$@" |
        awk '
            /\.metadata/ { next }
            /^ *(Downloading|Using cached|Processing) / {
                sub(/^ +/, "")
                sub(/ [^ ]*\//, " ")  # a URL or path: its file name is enough
                print "  " $0; fflush(); next
            }
            /^Requirement already satisfied/ { kept++; next }
            /^Successfully installed/ { print "  " $0; fflush(); next }
            END { if (kept) print "  " kept " requirement(s) already installed" }
        '
    return "${PIPESTATUS[0]}"
}
