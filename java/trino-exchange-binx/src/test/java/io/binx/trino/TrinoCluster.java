package io.binx.trino;

import static io.trino.testing.TestingSession.testSessionBuilder;

import com.google.inject.Key;
import com.google.inject.Module;
import io.binx.client.Binxd;
import io.trino.Session;
import io.trino.plugin.exchange.filesystem.FileSystemExchangePlugin;
import io.trino.plugin.tpch.TpchPlugin;
import io.trino.server.PluginInstaller;
import io.trino.server.testing.TestingTrinoServer;
import io.trino.testing.DistributedQueryRunner;
import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.stream.Stream;

/**
 * A coordinator and two workers in one JVM (Trino's {@link DistributedQueryRunner}) with the
 * {@code tpch} catalog, and the exchange manager of fault-tolerant execution: binx, each node
 * with a binxd process of its own and the plugin loaded from its plugin directory through
 * Trino's plugin class loader, or Trino's filesystem exchange. The cluster test and the TPC-H
 * benchmark share it.
 */
final class TrinoCluster implements AutoCloseable {
    /** The cluster's shared secret (the sidecars'). */
    static final String SECRET = "trino-test-cluster-secret";

    final DistributedQueryRunner runner;
    final List<Binxd> sidecars;
    /** The sidecars' shared store, or the filesystem exchange's directory. */
    final Path store;
    /**
     * The servers' base data directory, deleted on close (Trino's own default, a temporary
     * directory a server, outlives the cluster); binx's holds the plugin directory.
     */
    private final Path dataDir;

    private TrinoCluster(DistributedQueryRunner runner, List<Binxd> sidecars, Path store, Path dataDir) {
        this.runner = runner;
        this.sidecars = sidecars;
        this.store = store;
        this.dataDir = dataDir;
    }

    static Session tpch(String schema) {
        return testSessionBuilder().setCatalog("tpch").setSchema(schema).build();
    }

    /**
     * Three binxd processes on one shared {@code file://} store (arguments {@code sidecarArgs}
     * added to each) and a cluster whose nodes each use theirs through the binx plugin,
     * configured with {@code managerProperties} besides the socket.
     */
    static TrinoCluster binx(Map<String, String> extraProperties, Map<String, String> managerProperties,
            Optional<Module> module, String... sidecarArgs) throws Exception {
        Path store = Files.createTempDirectory("binx-trino-store");
        List<Binxd> sidecars = new ArrayList<>();
        Path pluginRoot = null;
        try {
            for (int i = 0; i < 3; i++) {
                List<String> args = new ArrayList<>(List.of("--spool-stores", "file://" + store.resolve("spool"),
                        "--spool-node-name", "node" + i, "--shared-secret", SECRET));
                args.addAll(List.of(sidecarArgs));
                sidecars.add(Binxd.start(args.toArray(String[]::new)));
            }
            pluginRoot = pluginRoot();
            DistributedQueryRunner.Builder<?> builder = DistributedQueryRunner.builder(tpch("tiny"))
                    .setWorkerCount(2)
                    .setExtraProperties(extraProperties)
                    .setBaseDataDir(Optional.of(pluginRoot))
                    .setAdditionalSetup(r -> {
                        List<TestingTrinoServer> servers = ((DistributedQueryRunner) r).getServers();
                        for (int i = 0; i < servers.size(); i++) {
                            TestingTrinoServer server = servers.get(i);
                            server.getInstance(Key.get(PluginInstaller.class)).loadPlugins();
                            Map<String, String> properties = new HashMap<>(managerProperties);
                            properties.put("exchange.binx.socket", sidecars.get(i).socket.toString());
                            server.loadExchangeManager("binx", properties);
                        }
                        tpchCatalog(r);
                    });
            module.ifPresent(builder::setAdditionalModule);
            return new TrinoCluster(builder.build(), sidecars, store, pluginRoot);
        } catch (Exception | Error e) {
            for (Binxd b : sidecars) {
                b.close();
            }
            delete(store);
            if (pluginRoot != null) {
                delete(pluginRoot);
            }
            throw e;
        }
    }

    /** The same cluster on Trino's own filesystem exchange, in a local directory. */
    static TrinoCluster filesystem(Map<String, String> extraProperties) throws Exception {
        Path store = Files.createTempDirectory("trino-fs-exchange");
        Path dataDir = null;
        try {
            dataDir = Files.createTempDirectory("trino-fs-data");
            DistributedQueryRunner runner = DistributedQueryRunner.builder(tpch("tiny"))
                    .setWorkerCount(2)
                    .setExtraProperties(extraProperties)
                    .setBaseDataDir(Optional.of(dataDir))
                    .setAdditionalSetup(r -> {
                        r.installPlugin(new FileSystemExchangePlugin());
                        r.loadExchangeManager("filesystem", Map.of("exchange.base-directories", store.toUri().toString()));
                        tpchCatalog(r);
                    })
                    .build();
            return new TrinoCluster(runner, List.of(), store, dataDir);
        } catch (Exception | Error e) {
            delete(store);
            if (dataDir != null) {
                delete(dataDir);
            }
            throw e;
        }
    }

    private static void tpchCatalog(io.trino.testing.QueryRunner r) {
        r.installPlugin(new TpchPlugin());
        // Decimals, not doubles: answers compare exactly whatever the order of sums.
        r.createCatalog("tpch", "tpch", Map.of("tpch.double-type-mapping", "DECIMAL"));
    }

    /** Trino loads every directory under plugin.dir as a plugin: one with ours alone. */
    private static Path pluginRoot() throws IOException {
        Path root = Files.createTempDirectory("binx-trino-plugins");
        Path source = Path.of(System.getProperty("binx.plugin.dir"));
        Path target = Files.createDirectories(root.resolve("binx"));
        try (Stream<Path> jars = Files.list(source)) {
            for (Path jar : jars.toList()) {
                Files.copy(jar, target.resolve(jar.getFileName()), StandardCopyOption.REPLACE_EXISTING);
            }
        }
        return root;
    }

    /** TPC-H query {@code n} (1 to 22), as in src/test/resources/tpch. */
    static String tpchQuery(int n) throws IOException {
        String name = String.format("tpch/q%02d.sql", n);
        try (InputStream in = TrinoCluster.class.getClassLoader().getResourceAsStream(name)) {
            if (in == null) {
                throw new IllegalStateException("no " + name);
            }
            return new String(in.readAllBytes(), StandardCharsets.UTF_8);
        }
    }

    static Session retryPolicy(Session session, String policy) {
        return Session.builder(session).setSystemProperty("retry_policy", policy).build();
    }

    /** Files left in the store (objects, markers, manifests; or the filesystem exchange's). */
    List<Path> storedFiles() throws IOException {
        return walk(store, Files::isRegularFile);
    }

    /**
     * Directories left in the sidecars' store below its root (a task's {@code commit/<task>/}
     * must go with its markers and manifest).
     */
    List<Path> storedDirectories() throws IOException {
        Path root = store.resolve("spool");
        return walk(root, p -> !p.equals(root) && Files.isDirectory(p));
    }

    /** The files under {@code root} (none when it is not there), listed as {@link #walk} does. */
    static List<Path> storedFiles(Path root) throws IOException {
        return walk(root, Files::isRegularFile);
    }

    /**
     * The paths under {@code root} that {@code keep} accepts. The sidecars may be deleting while
     * this walks: an entry that goes mid-walk makes it start again (a few times at most).
     */
    private static List<Path> walk(Path root, java.util.function.Predicate<Path> keep) throws IOException {
        for (int attempt = 1; ; attempt++) {
            try (Stream<Path> paths = Files.exists(root) ? Files.walk(root) : Stream.empty()) {
                return paths.filter(keep).toList();
            } catch (java.io.UncheckedIOException | java.nio.file.NoSuchFileException e) {
                if (attempt == 10) {
                    throw new IOException("the store under " + root + " kept changing while it was listed", e);
                }
            }
        }
    }

    @Override
    public void close() throws IOException {
        try {
            runner.close();
        } finally {
            for (Binxd b : sidecars) {
                b.close();
            }
            try {
                delete(store);
            } finally {
                delete(dataDir);
            }
        }
    }

    /** Shuts the managers down, then stops the sidecars, then deletes their shared store. */
    static void stopAll(List<io.trino.spi.exchange.ExchangeManager> managers, List<Binxd> sidecars, Path store)
            throws Exception {
        for (io.trino.spi.exchange.ExchangeManager m : managers) {
            m.shutdown();
        }
        for (Binxd b : sidecars) {
            b.close();
        }
        delete(store);
    }

    static void delete(Path dir) throws IOException {
        try (Stream<Path> files = Files.exists(dir) ? Files.walk(dir) : Stream.empty()) {
            files.sorted(java.util.Comparator.reverseOrder()).forEach(f -> f.toFile().delete());
        }
    }
}
