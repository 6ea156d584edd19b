"""Where the guard's findings go: sinks (local files, console, trackers through the integrations), the quarantine
store and its records, the background writer, alerts, charts, the engine view and the HTML report."""
