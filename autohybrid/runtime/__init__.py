"""Runtime: process launch (`autohybrid.runtime.launch`), process groups and schedules."""
