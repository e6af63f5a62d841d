package io.binx.trino;

import static com.google.inject.multibindings.OptionalBinder.newOptionalBinder;
import static io.airlift.configuration.ConfigBinder.configBinder;
import static io.trino.testing.TestingSession.testSessionBuilder;
import static org.assertj.core.api.Assertions.assertThat;

import com.google.inject.Key;
import com.google.inject.Module;
import com.google.inject.Scopes;
import io.binx.client.Binxd;
import io.trino.Session;
import io.trino.execution.FailureInjector;
import io.trino.execution.FailureInjector.InjectedFailureType;
import io.trino.execution.TestingFailureInjectionConfig;
import io.trino.execution.TestingFailureInjector;
import io.trino.plugin.tpch.TpchPlugin;
import io.trino.server.PluginInstaller;
import io.trino.server.testing.TestingTrinoServer;
import io.trino.spi.ErrorType;
import io.trino.testing.DistributedQueryRunner;
import io.trino.testing.FaultTolerantExecutionConnectorTestHelper;
import io.trino.testing.MaterializedResult;
import io.trino.testing.QueryAssertions;
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
import java.util.UUID;
import java.util.stream.Stream;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;

/**
 * A real Trino cluster (a coordinator and two workers, each with a binxd of its own on loopback,
 * one shared file:// store) with the binx plugin loaded from its plugin directory through
 * Trino's plugin class loader, running the 22 TPC-H queries under {@code retry-policy=TASK}:
 * every answer equals the same cluster's with {@code retry-policy=NONE}, also with task
 * attempts failed on purpose, and nothing is left in the sidecars' memory or storage after.
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
public class BinxTrinoClusterIT {
    private final List<Binxd> sidecars = new ArrayList<>();
    private Path store;
    private Path pluginRoot;
    private DistributedQueryRunner runner;
    private Session session;

    @BeforeAll
    void start() throws Exception {
        store = Files.createTempDirectory("binx-trino-store");
        for (int i = 0; i < 3; i++) {
            sidecars.add(Binxd.start("--spool-stores", "file://" + store.resolve("spool"),
                    "--spool-node-name", "node" + i, "--shared-secret", "trino-test-cluster-secret",
                    "--memory-limit", "512MiB", "--task-memory-limit", "256MiB"));
        }
        // Trino loads every directory under plugin.dir as a plugin: one with ours alone.
        pluginRoot = Files.createTempDirectory("binx-trino-plugins");
        Path source = Path.of(System.getProperty("binx.plugin.dir"));
        Path target = Files.createDirectories(pluginRoot.resolve("binx"));
        try (Stream<Path> jars = Files.list(source)) {
            for (Path jar : jars.toList()) {
                Files.copy(jar, target.resolve(jar.getFileName()), StandardCopyOption.REPLACE_EXISTING);
            }
        }
        session = testSessionBuilder().setCatalog("tpch").setSchema("tiny").build();
        Module failureInjection = binder -> {
            configBinder(binder).bindConfig(TestingFailureInjectionConfig.class);
            newOptionalBinder(binder, FailureInjector.class).setBinding().to(TestingFailureInjector.class).in(Scopes.SINGLETON);
        };
        Map<String, String> properties = new HashMap<>(FaultTolerantExecutionConnectorTestHelper.getExtraProperties());
        runner = DistributedQueryRunner.builder(session)
                .setWorkerCount(2)
                .setExtraProperties(properties)
                .setBaseDataDir(Optional.of(pluginRoot))
                .setAdditionalModule(failureInjection)
                .setAdditionalSetup(r -> {
                    DistributedQueryRunner d = (DistributedQueryRunner) r;
                    List<TestingTrinoServer> servers = d.getServers();
                    for (int i = 0; i < servers.size(); i++) {
                        TestingTrinoServer server = servers.get(i);
                        server.getInstance(Key.get(PluginInstaller.class)).loadPlugins();
                        server.loadExchangeManager("binx", Map.of(
                                "exchange.binx.socket", sidecars.get(i).socket.toString(),
                                "exchange.binx.max-error-duration", "30s"));
                    }
                    r.installPlugin(new TpchPlugin());
                    r.createCatalog("tpch", "tpch", Map.of("tpch.double-type-mapping", "DECIMAL"));
                })
                .build();
    }

    @AfterAll
    void stop() throws Exception {
        if (runner != null) {
            runner.close();
        }
        for (Binxd b : sidecars) {
            b.close();
        }
    }

    private static String query(int n) throws IOException {
        String name = String.format("tpch/q%02d.sql", n);
        try (InputStream in = BinxTrinoClusterIT.class.getClassLoader().getResourceAsStream(name)) {
            if (in == null) {
                throw new IllegalStateException("no " + name);
            }
            return new String(in.readAllBytes(), StandardCharsets.UTF_8);
        }
    }

    private Session policy(String policy) {
        return Session.builder(session).setSystemProperty("retry_policy", policy).build();
    }

    private void assertSameAnswers(int n, MaterializedResult expected, MaterializedResult actual) {
        QueryAssertions.assertEqualsIgnoreOrder(actual.getMaterializedRows(), expected.getMaterializedRows(),
                "TPC-H q" + n + " under retry-policy=TASK on binx");
    }

    @Test
    void tpchAnswersMatchWithoutRetriesAndNothingIsLeftBehind() throws Exception {
        for (int n = 1; n <= 22; n++) {
            String sql = query(n);
            MaterializedResult expected = runner.execute(policy("NONE"), sql);
            MaterializedResult actual = runner.execute(policy("TASK"), sql);
            assertSameAnswers(n, expected, actual);
        }
        // The exchange really went through the sidecars.
        long enqueued = 0;
        for (Binxd b : sidecars) {
            enqueued += b.stat("pages_enqueued");
        }
        assertThat(enqueued).isGreaterThan(0);
        awaitNothingLeft();
    }

    /** Task attempts fail on purpose at several stages; the answers stay exact. */
    @Test
    void failedTaskAttemptsAreRetriedExactly() throws Exception {
        for (int n : new int[] {3, 5, 9, 18}) {
            String sql = query(n);
            MaterializedResult expected = runner.execute(policy("NONE"), sql);
            for (int stage = 1; stage <= 3; stage++) {
                String token = UUID.randomUUID().toString();
                runner.injectTaskFailure(token, stage, 0, 0, InjectedFailureType.TASK_FAILURE, Optional.of(ErrorType.INTERNAL_ERROR));
                Session failing = Session.builder(policy("TASK")).setTraceToken(Optional.of(token)).build();
                assertSameAnswers(n, expected, runner.execute(failing, sql));
            }
        }
        awaitNothingLeft();
    }

    /** Every sidecar holds no memory and no task, and the store no object, within a minute. */
    private void awaitNothingLeft() throws Exception {
        long deadline = System.nanoTime() + 60_000_000_000L;
        while (true) {
            StringBuilder left = new StringBuilder();
            for (int i = 0; i < sidecars.size(); i++) {
                Binxd b = sidecars.get(i);
                long memory = b.stat("memory_used");
                long tasks = b.stat("tasks");
                if (memory != 0 || tasks != 0) {
                    left.append("sidecar ").append(i).append(": ").append(memory).append(" bytes, ").append(tasks).append(" tasks; ");
                }
            }
            List<Path> objects;
            try (Stream<Path> files = Files.exists(store) ? Files.walk(store) : Stream.empty()) {
                objects = files.filter(Files::isRegularFile).toList();
            }
            if (!objects.isEmpty()) {
                left.append(objects.size()).append(" objects in storage, e.g. ").append(objects.get(0));
            }
            if (left.isEmpty()) {
                return;
            }
            if (System.nanoTime() > deadline) {
                throw new AssertionError("left behind after the queries: " + left);
            }
            Thread.sleep(200);
        }
    }
}
