"""The `moekit` application: the command line and the jobs behind it (run, check, bench, tune, explain).

Data flow: `cli` parses argv (`cli_spec` turns flags into a spec and device) -> a job module (`run`,
`check`, `bench`, `autotune`) builds layers through the library (`moekit.ops`, `moekit.planning`), times
them with `timing` and returns a typed report -> `cli` prints it. The library never imports this package.
"""
