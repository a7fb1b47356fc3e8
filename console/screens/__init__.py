"""The console's screens: Dashboard, Training, Logs, and the confirmation modals."""
