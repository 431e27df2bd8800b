"""The adapters' life inside the engine: loads beside the step loop (`AdapterLoader`), who uses
each adapter (`AdapterUses`, what the scheduler asks), and the one owner of it all, from name to
GPU slot to retirement (`AdapterLifecycle`)."""
